"""Worker groups (Ray actors or plain processes, calls returning futures; DP sharding and the
split train step over a group) and their placement on GPUs: used by the generation backends
and the controller."""
