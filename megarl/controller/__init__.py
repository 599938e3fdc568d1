"""Ray single controller: resource pools, worker groups, dispatch/collect, and (in `workers.py`) worker classes.

The only megarl package that imports Ray. Import the submodules directly (`megarl.controller.worker_group`,
`.resource_pool`, `.ray_cluster`); `dispatch`, `batch_split` and `worker_env` are Ray-free so worker classes can
use them. This file imports nothing so that importing a Ray-free submodule does not pull Ray in.
"""
