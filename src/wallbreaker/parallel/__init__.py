"""Tensor parallelism on torch.distributed: the processes. Which slices of the weights a rank holds
and the layers that talk across ranks are the model's business (layers/shard.py, layers/parallel.py);
this package starts the ranks and carries each step to them.

group.py sets up the process groups; channel.py carries each step from rank 0 to the workers;
worker.py is a worker's loop; launcher.py starts the workers from rank 0 and stops them; runner.py
is rank 0's side of every step (ParallelModelRunner). Nothing here is imported when tensor_parallel_size is 1.
"""
