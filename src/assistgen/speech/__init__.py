"""Speech recognition on the generation loop: audio in, a Whisper target's transcript out (`transcribe`)."""
