"""Agentless provisioning over SSH: offline wheelhouse, resumable shard push, detached stage launch and stop.

Import the parts you need (``fleettui.provision.deploy`` pulls in asyncssh); this package itself is light.
"""
