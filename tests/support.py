"""Kept only for bench/cluster.py, which imports ProcessCluster from here:
the helpers moved to tests/framework (by concept). Once bench imports
tests.framework.cluster.Cluster, this file goes."""

from .framework.cluster import Cluster as ProcessCluster

__all__ = ["ProcessCluster"]
