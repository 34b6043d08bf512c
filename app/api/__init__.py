"""The OpenAI API as the gateway speaks it: request models, SSE bytes, errors, outcomes.

Owns what a request and an answer are on the wire and in the OpenAI shape, and the outcome
vocabulary every other package counts with. Imports nothing else of the gateway.
"""
