"""Why a worker failed: evidence from its exit and logs, classified by rules."""
