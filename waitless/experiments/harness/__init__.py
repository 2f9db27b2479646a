"""The training harness: run set-up, inputs, the loop, evaluation, checkpoints, preemption, replicas, measured time."""
