"""Layer 5: the Textual TUI. The only package that imports textual."""
