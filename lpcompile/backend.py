"""The ``lowprec`` torch.compile backend."""
