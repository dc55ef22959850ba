"""Agentless provisioning over SSH: offline wheelhouse, resumable shard push, detached stage launch
and stop.

Import the parts you need (``fleettui.provision.deploy`` pulls in asyncssh); this package itself is
light."""

import warnings

# cryptography 51 deprecates DSA and asyncssh (2.24) names its DSA key types when it is imported, so
# every command that reached SSH code printed six lines of CryptographyDeprecationWarning. We never
# offer or accept DSA keys (host and client keys are Ed25519); a warning from anywhere else still
# shows.
warnings.filterwarnings("ignore", message="DSA is deprecated", module=r"asyncssh(\.|$)")
