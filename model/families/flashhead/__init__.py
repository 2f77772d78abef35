"""SoulX-FlashHead (Pro, Lite): the model side of the family."""
