"""Node-local storage: atomic publication, waiting, recycled frame files."""
