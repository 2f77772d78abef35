"""The built-in agent's parts for real: pocketsphinx on espeak speech, the domain trigram, the reply
rules, and the agent hearing a user through silero-vad (its default recogniser, Whisper) and
answering with espeak speech."""

from __future__ import annotations

import math
import time
from collections import defaultdict

import anyio
import numpy as np
import pytest

from charstream.stages.agents.asr import SpeechRecognizer
from charstream.stages.agents.domain_lm import arpa_text, corpus_lines, words
from charstream.stages.agents.listening import ListeningAgent, sentences
from charstream.stages.agents.reply_policy import NOTHING_HEARD, RULES, reply
from charstream.stages.agents.tts import synthesize
from charstream.stages.config import IngestConfig
from charstream.stages.ingest.adapters import AgentAudioFrame, AgentTurnEnd, AgentTurnStart, UserAudioFrame
from charstream.stages.ingest.resample import resample, to_int16
from charstream.stages.ingest.vad import UserAudioVAD
from charstream.transport.messages import TraceContext, TurnEvent


def mic_audio(text: str, voice: str = "en-us", lead_s: float = 0.5, tail_s: float = 1.0) -> np.ndarray:
    speech = synthesize(text, voice)
    audio = resample(speech.samples.astype(np.float32) / 32768.0, speech.sample_rate, 48_000)
    return to_int16(np.concatenate([np.zeros(int(lead_s * 48_000)), audio, np.zeros(int(tail_s * 48_000))]))


async def speak(agent: ListeningAgent, vad: UserAudioVAD, audio: np.ndarray, turn: int, paced: bool = False) -> None:
    """The microphone's 20 ms frames to the agent, the VAD's events on them as turn ``turn``'s; ``paced``: at
    real time, stopping once the agent has taken the turn."""
    t0 = time.time()
    for i in range(0, len(audio), 960):
        frame = UserAudioFrame(audio[i:i + 960], 48_000, t0 + i / 48_000)
        await agent.hear(frame)
        for e in vad.feed(frame.samples, frame.at):
            await agent.notify(TurnEvent("s", i, e.kind, turn, e.at, TraceContext(turn)))
        if paced:
            await anyio.sleep(max(0.0, t0 + (i + 960) / 48_000 - time.time()))
            if agent.turns:
                return


def test_recogniser_hears_in_domain_speech_streamed_in_20ms_frames():
    recogniser = SpeechRecognizer("domain")
    audio = mic_audio("please stop talking", tail_s=0.3)
    recogniser.begin()
    for i in range(0, len(audio), 960):
        recogniser.feed(audio[i:i + 960])
    transcript = recogniser.end()
    assert transcript.text == "please stop talking"
    assert abs(transcript.audio_s - len(audio) / 48_000) < 0.01  # every sample reached the decoder at 16 kHz
    assert transcript.finalize_s < 0.5
    with pytest.raises(RuntimeError, match="outside an utterance"):
        recogniser.feed(audio[:960])


def test_recogniser_refuses_unknown_language_model():
    with pytest.raises(ValueError, match="domain"):
        SpeechRecognizer("klingon")


def test_domain_trigram_is_a_distribution_with_backoff():
    """Each bigram history's explicit probabilities plus its backoff mass sum to one (checked on
    the ARPA text itself, the way a decoder reads it)."""
    text = arpa_text([["hello", "there"], ["hello", "you"], ["hi", "there"]])
    probs: dict[tuple[str, ...], float] = {}
    backoffs: dict[tuple[str, ...], float] = {}
    order = 0
    for line in text.splitlines():
        if line.endswith("-grams:"):
            order = int(line[1])
        elif order and line and not line.startswith("\\"):
            fields = line.split("\t")
            gram = tuple(fields[1].split())
            probs[gram] = 10 ** float(fields[0])
            if len(fields) > 2:
                backoffs[gram] = 10 ** float(fields[2])
    unigrams = {g[0]: p for g, p in probs.items() if len(g) == 1 and g != ("<s>",)}
    assert math.isclose(sum(unigrams.values()), 1.0, rel_tol=1e-4)
    followers = defaultdict(dict)
    for gram, p in probs.items():
        if len(gram) == 2:
            followers[gram[:1]][gram[1]] = p
    for history, seen in followers.items():
        unseen = sum(p for w, p in unigrams.items() if w not in seen)
        total = sum(seen.values()) + backoffs[history] * unseen
        assert math.isclose(total, 1.0, rel_tol=0.02), (history, total)


def test_corpus_words_are_all_in_the_dictionary():
    from charstream.stages.agents.asr import _model_files

    dictionary = {line.split()[0].split("(")[0] for line in open(_model_files()["dict"], encoding="utf-8")}
    missing = {w for line in corpus_lines() for w in line} - dictionary
    assert not missing


def test_replies_are_honest_and_cover_what_was_heard():
    assert "not a language model" in reply("are you a language model")
    assert "video model" in reply("how do you make your face move")
    assert reply("") == NOTHING_HEARD
    unknown = reply("purple elephants dance")
    assert "purple elephants dance" in unknown  # says what it heard when no rule fits
    assert all(r.reply for r in RULES)
    assert "3 years" in reply("I have played chess for 3 years")  # quoted as heard, numbers too


def test_replies_name_the_topic_they_heard():
    assert reply("My uncle adopted two dogs last month.") == "You mentioned dogs! What are their names?"
    assert reply("I play the piano on weekends.").startswith("You mentioned piano.")
    assert reply("Is it snowing where you are?").startswith("I can't look outside")
    assert reply("My daughter starts university in the autumn.").startswith("You mentioned your daughter.")
    # a word inside another is no topic: "built" is not "how were you made", "dogsled" not "dogs"
    assert reply("They built a dogsled.").startswith("I heard you say: They built a dogsled.")
    assert sentences("Hello! I'm Ada. Ask me.") == ["Hello!", "I'm Ada.", "Ask me."]
    assert words("What's up?") == ["what's", "up"]


def test_agent_hears_the_user_through_the_vad_and_answers_with_speech():
    """Real silero-vad decides the turn; the agent recognises the utterance, answers by the rules,
    and streams espeak speech; the turn start says what was heard and answered."""

    async def main():
        agent = ListeningAgent(IngestConfig())
        await agent.start()
        vad = UserAudioVAD(sample_rate=48_000)
        audio = mic_audio("sorry, can I stop you there?")
        events: list = []

        async def user():
            await speak(agent, vad, audio, 7)  # faster than real time: the reply streams while it is fed

        async def agent_side():
            async for event in agent.events():
                events.append(event)
                if isinstance(event, AgentTurnEnd):
                    return

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(agent_side)
                await user()
        await agent.close()
        return agent, events

    agent, events = anyio.run(main)
    start, *frames, end = events
    assert isinstance(start, AgentTurnStart) and start.turn_ref == 7
    assert "stop you" in start.heard and "listen to you" in start.answer
    assert all(isinstance(f, AgentAudioFrame) for f in frames) and isinstance(end, AgentTurnEnd)
    assert end.reason == "done"
    seconds = sum(len(f.samples) / f.sample_rate for f in frames)
    assert seconds > 2.0  # the whole answer was spoken
    [turn] = agent.turns
    # a stall bound only: the audio came faster than real time, so the final decode ran after the end
    assert turn.turn_id == 7 and turn.heard == start.heard and turn.finalize_s < 5.0


def test_the_answer_is_ready_when_the_turn_ends():
    """Audio at the microphone's pace: the recogniser's guess in the pause after the speech readies
    the answer's first sentence, so its audio is not synthesised after the VAD's end."""

    async def main():
        agent = ListeningAgent(IngestConfig())
        await agent.start()
        vad = UserAudioVAD(sample_rate=48_000)
        audio = mic_audio("Could you tell me a story?")
        first = None
        await speak(agent, vad, audio, 3, paced=True)
        async for event in agent.events():
            if isinstance(event, AgentAudioFrame):
                first = event
                break
        await agent.close()
        return agent, first

    agent, first = anyio.run(main)
    [turn] = agent.turns
    assert "story" in turn.heard.lower() and turn.answer.startswith("Once there was")
    assert first is not None and agent.ready_used == 1
