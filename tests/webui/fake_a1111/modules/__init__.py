"""Fake AUTOMATIC1111 ``modules`` package for the adapter's tests (mirrors v1.10.1's API, see a1111-host.md)."""
