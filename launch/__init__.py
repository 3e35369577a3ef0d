"""Starting hybridflow jobs on one machine or a cluster.

This package will hold the torchrun and Slurm launchers: the environment and rendezvous
settings each rank needs, sbatch script rendering from the config, and a dry run that prints
the commands and the rank-to-role placement without starting any process.
"""
