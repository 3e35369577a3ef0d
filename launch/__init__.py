"""Starting hybridflow jobs on one machine or a cluster.

    torchrun.py    hybridflow train: one node, torchrun --standalone; the checks before any rank starts
    multinode.py   hybridflow launch: one node of several, c10d rendezvous, restarts that resume
    slurm.py       hybridflow slurm: the run's sbatch script (srun + a launch per node, requeue-safe)
    faults.py      a harness that SIGKILLs ranks of a running launch and checks the run survives
"""
