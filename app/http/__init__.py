"""The client side: the HTTP/1.1 server protocol, the request's arrival, trace and body.

Owns the client's connection (:mod:`app.http.front` parses and bounds each request,
:mod:`app.http.connection` its transport and order, :mod:`app.http.exchange` one request and its
response, :mod:`app.http.writer` the response-writer seam, :mod:`app.http.server`), the request id
and the recording of what no relay records (:mod:`app.http.trace`), and reading a body within
its limits (:mod:`app.http.body`). May import :mod:`app.api`, :mod:`app.observe`,
:mod:`app.settings` and :mod:`app.shutdown`; it knows nothing of workers, admission or the
relay, and reaches the running gateway only through hooks put in the lifespan's state.
"""
