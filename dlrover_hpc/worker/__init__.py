"""What runs inside the training processes: the records a worker shares with its agent
(progress, membership) and the hooks the agent puts into every worker.

Code of the training processes also lives in :mod:`dlrover_hpc.trainer` (the public API under
DLRover's module paths), :mod:`dlrover_hpc.checkpoint.trainer` (the checkpoint's trainer side)
and :mod:`dlrover_hpc.data.client`.  None of it imports the agent, the master, ssh or cli (an
import-linter contract).
"""
