"""The torch parts every family builds its blocks from: attention and the block."""
