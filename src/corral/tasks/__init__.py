"""Tasks in harbor's (terminal-bench's) format, run on Corral."""
