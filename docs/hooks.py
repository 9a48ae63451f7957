"""MkDocs hook: inline code may break after a dot or an opening bracket, never inside a name.

`tf.compat.v1.mixed_precision.DynamicLossScale` in a table cell is one word to a browser;
the stylesheet stops it from breaking anywhere (`DynamicLoss` over `Scale`), so without a place
to break it would widen its table past the page. A `<wbr>` after each `.`, `(` and `[` of inline
code (not of code blocks) gives it those places.
"""

import re

INLINE_CODE = re.compile(r"(<pre\b.*?</pre>)|<code>(.*?)</code>", re.DOTALL)
BREAK_AFTER = re.compile(r"(?<=[.(\[])(?=[A-Za-z_])")


def wrap_code(html: str) -> str:
    """`html` with a `<wbr>` after each dot or opening bracket of inline code that a name
    follows: `a.b(c)` -> `a.<wbr>b(<wbr>c)`; a number (`2.0`) stays whole."""

    def wrap(match: re.Match[str]) -> str:
        if match[1] is not None:
            return match[1]
        parts = re.split(r"(<[^>]*>)", match[2])  # the text between tags, never a tag's
        text = [part if part.startswith("<") else BREAK_AFTER.sub("<wbr>", part) for part in parts]
        return "<code>" + "".join(text) + "</code>"

    return INLINE_CODE.sub(wrap, html)


def on_page_content(html: str, **_: object) -> str:
    return wrap_code(html)
