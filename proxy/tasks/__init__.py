"""Tasks: the record and its lifecycle, where records are kept, and the background calls that drive them."""
