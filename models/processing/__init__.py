"""Turning user inputs into what the graphs read: images (and, as they land, audio and video)."""
