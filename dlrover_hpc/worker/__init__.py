"""What runs inside the training processes, besides the public API of
:mod:`dlrover_hpc.trainer` (DLRover's module paths), the checkpoint's trainer side
(:mod:`dlrover_hpc.checkpoint.trainer`) and the data client (:mod:`dlrover_hpc.data.client`):
the progress and membership records a worker shares with its agent, and the hooks the agent
puts into every worker.  None of it imports the agent, the master, ssh or cli (an import-linter
contract)."""
