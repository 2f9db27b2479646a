"""The shaped test bed: hosts on one machine (network namespaces, CPU quotas, tc-shaped links)."""
