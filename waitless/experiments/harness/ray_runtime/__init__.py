"""The Ray runtime: the parameter-server family on real, independent workers (`runtime=ray`).

`arrivals` (which pushes an update takes), `server` (the model and the algorithm's own update), `worker` (a
learner: fetch, compute, push), `driver` (the run: actors, failures; its files through `recorder.RunRecorder`),
`events` (the event log, written and read back), `ray_config` (the config's checks), `pieces` (a run's pieces
built for one device).
"""
