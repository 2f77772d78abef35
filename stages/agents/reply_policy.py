"""The built-in agent's replies: a handful of rules over what the recogniser heard. No language model
and no pretence of one — the character says what it is when asked, repeats back what it heard when
no rule fits, and asks back, so a user can always tell what was understood.

    reply("how does your face move")   # -> "A small video model draws my face from my voice, ..."

Rules are tried in order; the first with one of its words or phrases in the transcript (whole
words) answers. Nothing heard at all gets a request to repeat.
"""

from __future__ import annotations

from dataclasses import dataclass

from charstream.stages.agents.domain_lm import words


@dataclass(frozen=True)
class Rule:
    any_of: tuple[str, ...]  # words or two-word phrases; one is enough
    reply: str


RULES: tuple[Rule, ...] = (
    Rule(("language model", "chat gpt", "ai", "robot", "computer", "human", "real person", "alive", "are you real"),
         "I'm a simple rule-based voice agent, not a language model: I match a few words of what I hear "
         "and pick an answer. The face is real though, drawn live by a video model."),
    Rule(("face", "mouth", "move", "video", "made", "built", "how do you work", "how does this work"),
         "A small video model draws each frame of my face from my voice, four frames at a time, as I speak."),
    Rule(("interrupt", "while you", "stop you"),
         "Yes. If you start speaking while I talk, I stop and listen to you."),
    Rule(("stop", "wait", "hold on", "quiet"),
         "Okay, I'm listening."),
    Rule(("hear", "understand", "listening", "working", "microphone", "are you there"),
         "Yes, I can hear you. My speech recogniser runs right here, offline."),
    Rule(("name", "who are you", "who is this", "who am i", "yourself"),
         "I'm Ada, a live video character. What's your name?"),
    Rule(("weather", "rain", "sunny", "cold", "warm"),
         "I can't look outside or go online, so I don't know the weather. How is it where you are?"),
    Rule(("time", "date", "day"),
         "I don't keep a calendar, sorry. Is there something else you'd like to talk about?"),
    Rule(("story",),
         "Once there was a face made of numbers. It learned to smile by listening. Would you like another?"),
    Rule(("joke", "funny", "laugh"),
         "Why did the video frame go to school? To get a little more resolution."),
    Rule(("thank", "thanks"),
         "You're welcome!"),
    Rule(("bye", "goodbye", "good night", "see you", "have to go"),
         "Goodbye! It was nice talking with you."),
    Rule(("how are you", "how is it going", "what's up"),
         "I'm well, thank you. How are you?"),
    Rule(("hello", "hi", "hey", "good morning", "good afternoon", "good evening"),
         "Hello! I'm Ada. Ask me how I work, or tell me something."),
    Rule(("what can you do", "help"),
         "I can hear you, answer a few kinds of questions and move my face as I talk. Try asking how I work."),
    Rule(("yes", "yeah", "sure", "okay", "ok", "fine", "good", "great", "cool", "nice"),
         "Good. What would you like to talk about?"),
    Rule(("no", "not"),
         "All right. Is there something else you'd like to ask?"),
)

NOTHING_HEARD = "Sorry, I didn't catch that. Could you say it again?"


def reply(transcript: str) -> str:
    """The character's answer to ``transcript`` (what the recogniser heard)."""
    heard = words(transcript)
    if not heard:
        return NOTHING_HEARD
    text = " " + " ".join(heard) + " "
    for rule in RULES:
        if any(f" {phrase} " in text for phrase in rule.any_of):
            return rule.reply
    quoted = " ".join(heard[:8])
    return f"I heard you say: {quoted}. I only know a few topics; could you ask me something else?"
