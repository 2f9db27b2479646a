"""The algorithms, each an optax `GradientTransformationExtraArgs` built by a factory in its module.

Shared by every factory: `axis_name` names the worker axes of the caller's `jax.shard_map` (None: one worker, no
collective). One worker per device: the mesh axis. Several workers per device: vmap them inside the shard_map
and pass `(mesh_axis, vmap_axis)`, and call `jax.shard_map(..., check_vma=False)` (JAX's varying-axes check
does not know vmap axes; `collectives` raises a ValueError saying so). `update(grads, state, params, ...)`
returns this worker's updates and new state; `init(params)` returns a state that shares no array with `params`
(a step may donate both). README.md, "Using an algorithm in your own training step", and examples/.
"""
