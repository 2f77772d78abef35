"""Egress: a session's playout streamed over WebRTC (aiortc), with client timing reports.

- ``server.py`` — ``EgressServer``: aiohttp signaling (``POST /session``, ``/offer``, ``/hangup``),
  one aiortc peer connection per session; a ``SessionFactory`` (``async (session_id) ->
  SessionMedia``) supplies each session's ``PlayoutOutput``, peer link, mic queue and close hook.
- ``stage.py`` — ``EgressStage``: the session graph's egress node (pings, liveness, tells the page
  why a session ended) and ``PeerLink``, its tie to the peer connection.
- ``tracks.py`` — video (90 kHz) and audio (48 kHz, 20 ms) tracks paced by the playout clock.
- ``mic.py`` — ``UserAudioQueue``: the user's microphone for ingest's VAD (48 kHz mono int16).
- ``timing.py`` — data-channel protocol: ping/pong clock offset, presented-frame reports,
  ``client_first_speaking_frame``.
- ``client.py`` — ``EgressClient``: the in-process aiortc client (tests, benchmarks, the demo's
  ``session.mp4`` recorder); ``AudioSamplesTrack``: a scripted microphone.
- ``testcard.py`` — the test card, and ``CardSource``: the card as the source stage of a session
  graph without a model (``charstream serve --source testcard``, tests, benchmarks).
- ``static/`` — the web page.
"""
