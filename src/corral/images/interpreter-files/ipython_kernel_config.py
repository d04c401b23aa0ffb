# Corral's code-interpreter kernels: plain tracebacks (the client shows them
# as text), and sequences shown whole.
c = get_config()  # noqa: F821
c.InteractiveShell.colors = "NoColor"
c.PlainTextFormatter.max_seq_length = 0
