"""Small-scale reproductions of the three papers lowprec implements (one script each)."""
