"""Deployment: the `specserve` CLI, config files and the Ray Serve app builder."""
