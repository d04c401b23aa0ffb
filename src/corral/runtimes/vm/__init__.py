"""MicroVM and FullVM backends on QEMU (issue 7, in progress)."""
