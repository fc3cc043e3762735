"""Bare metal: the hostfile, the blocklist and the SSH launcher behind ``dlrover-hpc launch``."""
