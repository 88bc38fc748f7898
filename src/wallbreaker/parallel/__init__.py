"""Tensor parallelism on torch.distributed: heads, MLP columns and the vocabulary split across ranks.

shard.py says which rows and columns a rank holds; layers.py has the pieces that talk across ranks;
group.py sets up the process groups; channel.py carries each step from rank 0 to the workers;
worker.py is a worker's loop; launcher.py starts and stops the workers from rank 0; runner.py is
rank 0's model runner. Nothing here is imported when tensor_parallel_size is 1, except shard.py's
plain ranges.
"""
