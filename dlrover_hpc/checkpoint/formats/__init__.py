"""On-disk formats: torch.save archives (`torchfile`, `torchfile_reader`), their ZIP container
(`zip_archive`, no torch) and the torch.distributed.checkpoint layout pieces (`dcp_layout`)."""
