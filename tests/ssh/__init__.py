"""Tests against real OpenSSH sshd hosts in network namespaces (root)."""
