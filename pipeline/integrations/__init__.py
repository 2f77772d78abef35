"""Integrations with the voice-agent frameworks that drive a charstream session.

``pipecat`` (``CharstreamVideoService``, extra ``pipecat``), ``livekit`` (``CharstreamVideoGenerator``,
extra ``livekit``), ``agent_client`` (``ExternalAgentClient``: an agent of your own over ZeroMQ) and
``embedded`` (``EmbeddedSession``, the embedded session the framework integrations share).
"""
