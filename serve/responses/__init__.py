"""The OpenAI Responses API (`/v1/responses`): a request becomes a chat request (request.py), runs
through the chat path's parsing, reasoning split and tool parsers, and comes back as output items
(output.py) or as the documented stream of events (events.py); finished responses are kept in a
bounded LRU store (store.py) for `previous_response_id`, GET and DELETE (handlers.py)."""
