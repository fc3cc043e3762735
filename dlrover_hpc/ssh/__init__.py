"""Bare metal: the hostfile, the blocklist and the SSH launcher behind ``dlrover-hpc launch``."""

import warnings

# cryptography 47 and later deprecate DSA and other old algorithms that asyncssh still names
# when it is imported: ten lines of CryptographyDeprecationWarning on every `dlrover-hpc
# launch`, before its own output, and nothing a user can act on.  Only asyncssh's own
# imports are quieted (the warnings are attributed to its modules).
warnings.filterwarnings("ignore", message=r".* is deprecated", module=r"asyncssh(\.|$)")
