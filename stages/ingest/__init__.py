"""Ingest: voice-agent adapters, TTS for the built-in agent, VAD turn detection."""
