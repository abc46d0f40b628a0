"""Errors both sides of the manager channel name: the manager raises them, and the trainer raises
the same type for the same condition (each trainer rank checks the live-server floor itself)."""


class ClusterError(RuntimeError):
    """Too few rollout servers left to go on (rollout.min_live_servers)."""
