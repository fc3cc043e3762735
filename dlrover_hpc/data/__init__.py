"""Dynamic data sharding: the master hands out index ranges of a dataset on request, and every
sample of an epoch reaches the model exactly once across failures and world-size changes."""
