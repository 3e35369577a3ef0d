"""Starting hybridflow jobs on one machine or a cluster.

    torchrun.py    hybridflow train: one node, torchrun --standalone
    multinode.py   hybridflow launch: one node of several, c10d rendezvous, restarts that resume
    slurm.py       hybridflow slurm: the run's sbatch script (srun + a launch per node, requeue-safe)
    reaper.py      runs torchrun so that nothing a crashed rank started outlives the job

The package takes plain values (the actor's ``hfschema.layout.ParallelLayout``, the config path
and overrides, one-line descriptions) and never reads the run config: the checks before any
rank starts are ``hybridflow.preflight``'s, and the fault-injection harness that SIGKILLs ranks
of a running launch is ``hybridflow.faults``.
"""
