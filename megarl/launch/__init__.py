"""Starting a job: the launch plan behind ``megarl-launch`` (local, torchrun, SLURM, MPI), rank
discovery under a launcher, SLURM host lists, local ranks without torchrun, and the preflight
checks that run before any rank starts."""
