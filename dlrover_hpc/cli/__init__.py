"""The commands: dlrover-run and dlrover-hpc's subcommands (argparse, logging, exit codes)."""
