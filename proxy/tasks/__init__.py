"""Tasks: the record and its lifecycle, and the background calls that drive them (records are kept in store/)."""
