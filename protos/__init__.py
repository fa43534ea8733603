"""The versioned wire schema (onestream.v1) and its generated Python code."""
