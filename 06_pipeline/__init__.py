"""Chapter 06: not written yet (see the course map in README.md)."""
