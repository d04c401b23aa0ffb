"""Images built from Dockerfiles, step by step in Corral sandboxes."""
