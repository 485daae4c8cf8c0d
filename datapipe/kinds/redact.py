"""Secrets and personal data replaced by placeholders, as BigCode's PII pipeline does for The Stack.

What is found (each kind can be turned off in `redact:`):
- secrets (`<KEY>`, `<PASSWORD>`): detect-secrets' plugins, the set BigCode's `pii/utils/keys_detection.py`
  runs (AWS, Artifactory, Azure storage, Cloudant, Discord, GitHub, IBM, JWT, Mailchimp, npm, SendGrid,
  Slack, SoftLayer, Stripe, Twilio; high-entropy base64 and hex strings) plus those it left out or that came
  later: private keys (the whole PEM / PGP / OpenSSH block is replaced, not only its first line), keyword
  assignments (`password = "..."`, `<PASSWORD>`), credentials in URLs, GitLab, OpenAI, PyPI, Square and
  Telegram tokens. detect-secrets' heuristic filters drop UUIDs, sequential strings, templated values and
  identifiers, as BigCode's do; allow-list pragmas are not honoured (they mark a test secret, which is still
  a secret to a model). A key or token is replaced wherever it occurs, as BigCode does (up to the end of the
  token, where a plugin's lazy pattern stops short, as for a JWT's signature); a keyword's value only on the
  line where it was found (`password: "yes"` must not take every `yes` of the file);
- e-mail addresses (`<EMAIL>`) and public IPv4 addresses (`<IP_ADDRESS>`): datatrove's PIIFormatter patterns
  (the FineWeb pipeline's), keeping private and reserved addresses, the public DNS resolvers and
  `x.x.x.x` version strings as BigCode's redaction does.
Lines are scanned by detect-secrets only where one of its plugins could match (a regex built from the
plugins' own patterns and the entropy plugins' minimum lengths), which is what keeps it fast on code.
"""
from __future__ import annotations

import math
import re
from collections import Counter

from datatrove.pipeline.base import PipelineStep

PLUGINS = ("ArtifactoryDetector", "AWSKeyDetector", "AzureStorageKeyDetector", "BasicAuthDetector",
           "CloudantDetector", "DiscordBotTokenDetector", "GitHubTokenDetector", "GitLabTokenDetector",
           "IbmCloudIamDetector", "IbmCosHmacDetector", "JwtTokenDetector", "KeywordDetector", "MailchimpDetector",
           "NpmDetector", "OpenAIDetector", "PrivateKeyDetector", "PypiTokenDetector", "SendGridDetector",
           "SlackDetector", "SoftlayerDetector", "SquareOAuthDetector", "StripeDetector",
           "TelegramBotTokenDetector", "TwilioKeyDetector")
ENTROPY = {"Base64HighEntropyString": 4.5, "HexHighEntropyString": 3.0}
FILTERS = ("is_sequential_string", "is_potential_uuid", "is_likely_id_string", "is_templated_secret",
           "is_prefixed_with_dollar_sign", "is_indirect_reference", "is_not_alphanumeric_string")
PASSWORD_TYPES = {"Secret Keyword", "Basic Auth Credentials"}
_PEM = re.compile(r"-----BEGIN ((?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?)-----.*?-----END \1-----", re.S)
# a block cut short (no END line): the BEGIN line and the header and base64 lines after it
_PEM_CUT = re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----(?:\n[A-Za-z0-9+/=:,\- \t\\]*)*")
_PUTTY = re.compile(r"PuTTY-User-Key-File-\d+:.*?Private-MAC: *\S*", re.S)
DNS_SERVERS = frozenset({"8.8.8.8", "8.8.4.4", "1.1.1.1", "1.0.0.1", "76.76.19.19", "76.223.122.150", "9.9.9.9",
                         "149.112.112.112", "208.67.222.222", "208.67.220.220", "8.26.56.26", "8.20.247.20",
                         "94.140.14.14", "94.140.15.15"})
_DOTTED_QUAD = re.compile(r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d")  # what every IPv4 match holds: a cheap first look
_settings_done = False


def _configure() -> None:
    """detect-secrets' settings are process-global: set once, to our plugins and filters."""
    global _settings_done
    if _settings_done:
        return
    from detect_secrets.settings import configure_settings_from_baseline

    configure_settings_from_baseline({
        "plugins_used": [{"name": n} for n in PLUGINS] + [{"name": n, "limit": v} for n, v in ENTROPY.items()],
        "filters_used": [{"path": f"detect_secrets.filters.heuristic.{f}"} for f in FILTERS]})
    _settings_done = True


# detect-secrets' leading context ("at a word start", "after a space, = or quote"): dropped from the line gates
# (a superset of the lines that match), since an alternation that matches almost anywhere is slow to scan for
_CONTEXT = ("(?:(?<=\\W)|(?<=^))", '(?:\\s|=|:|"|^)')
_LONG_RUN = re.compile(r"\]\{(\d+)(?:,\d*)?\}")
_RUN_CHARS = {c: "A" if re.fullmatch(r"[A-Za-z0-9_\-+/=]", chr(c)) else " " for c in range(128)}


def _lower_pattern(p: str) -> str:
    """A pattern that, without IGNORECASE, matches the lower-cased text wherever `(?i:p)` matches the text:
    letters lower-cased outside escapes (`\\W` stays `\\W`)."""
    out, i = [], 0
    while i < len(p):
        out.append(p[i:i + 2] if p[i] == "\\" else p[i].lower())
        i += 2 if p[i] == "\\" else 1
    return "".join(out)


def line_gates() -> list[tuple[re.Pattern, bool, int]]:
    """(pattern, on lower-cased text, run) triples: a line that no gate matches cannot be flagged by any of
    the plugins. Each plugin's own patterns (case-insensitive ones lower-cased, as regex engines are slow at
    IGNORECASE alternations; the leading word-start lookbehind dropped), the keyword list, and quoted strings
    long enough to pass an entropy limit (n distinct symbols carry at most log2(n) bits each). `run` > 0: the
    pattern needs a run of that many key characters, and only lines with one are searched (the
    keyword-then-44-characters patterns are slow everywhere else)."""
    from detect_secrets.plugins.keyword import DENYLIST
    from detect_secrets.settings import get_plugins

    _configure()
    gates = [(re.compile("|".join(DENYLIST)), True, 0)]
    for plugin in get_plugins():
        if hasattr(plugin, "denylist"):
            for p in plugin.denylist:
                text = p.pattern
                for ctx in _CONTEXT:
                    text = text.replace(ctx, "")
                runs = [int(n) for n in _LONG_RUN.findall(text)]
                run = max(runs) if runs and max(runs) >= 24 else 0
                gates.append((re.compile(_lower_pattern(text)), True, run) if p.flags & re.I
                             else (re.compile(text), False, run))
        elif hasattr(plugin, "charset"):
            n = math.floor(2 ** plugin.entropy_limit) + 1
            gates.append((re.compile(r"[\"'][%s]{%d,}[\"']" % (re.escape(plugin.charset), n)), False, 0))
    return gates


def candidate_lines(text: str, gates) -> list[int]:
    """Indices (in `text.split("\\n")`) of the lines some gate matches."""
    import bisect

    low = text.lower()
    newlines = [m.start() for m in re.finditer("\n", text)]
    low_newlines = newlines if len(low) == len(text) else [m.start() for m in re.finditer("\n", low)]
    marked, hits = {}, set()
    for pat, lowered, run in gates:
        src, nl = (low, low_newlines) if lowered else (text, newlines)
        if not run:
            hits.update(bisect.bisect_left(nl, m.start()) for m in pat.finditer(src))
            continue
        if lowered not in marked:
            marked[lowered] = src.translate(_RUN_CHARS)
        pos = marked[lowered].find("A" * run)
        while pos >= 0:  # each line holding a long run: searched on its own
            line = bisect.bisect_left(nl, pos)
            a, b = (nl[line - 1] + 1 if line else 0), (nl[line] if line < len(nl) else len(src))
            if pat.search(src, a, b):
                hits.add(line)
            pos = marked[lowered].find("A" * run, b)
    return sorted(hits)


def _slug(secret_type: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", secret_type.lower()).strip("_")


class Redactor:
    """`redact(text, path)` → (text with placeholders, counts per kind of finding)."""

    def __init__(self, secrets: bool = True, emails: bool = True, ip_addresses: bool = True):
        self.secrets, self.emails, self.ip_addresses = secrets, emails, ip_addresses
        self._gates = None
        from datatrove.pipeline.formatters.pii import PIIFormatter

        pii = PIIFormatter()
        self._email, self._ip = pii.emails_replacer.regex, pii.ip_replacer.regex

    def redact(self, text: str, path: str = "file.txt") -> tuple[str, Counter]:
        counts: Counter = Counter()
        if self.secrets:
            text = self._private_keys(text, counts)
            text = self._detect_secrets(text, path, counts)
        if self.emails and "@" in text:
            text = self._emails(text, counts)
        if self.ip_addresses and _DOTTED_QUAD.search(text):
            text = self._ip.sub(lambda m: self._ip_repl(m, text, counts), text)
        return text, +counts

    def _emails(self, text: str, counts: Counter) -> str:
        """datatrove's e-mail pattern, searched only in the lines holding an `@` (it starts with a class that
        matches most characters, and no address spans a line)."""
        parts, done, pos = [], 0, text.find("@")
        while pos >= 0:
            a, b = text.rfind("\n", 0, pos) + 1, text.find("\n", pos)
            b = len(text) if b < 0 else b
            for m in self._email.finditer(text, a, min(b + 1, len(text))):
                parts += [text[done:m.start()], "<EMAIL>"]
                done = m.end()
                counts["email"] += 1
            pos = text.find("@", b)
        return "".join(parts) + text[done:] if parts else text

    @staticmethod
    def _private_keys(text: str, counts: Counter) -> str:
        if "PRIVATE KEY" not in text and "PuTTY-User-Key-File" not in text:
            return text
        text, n = _PEM.subn("<KEY>", text)
        text, m = _PEM_CUT.subn("<KEY>", text)
        text, k = _PUTTY.subn("<KEY>", text)
        counts["private_key"] += n + m + k
        return text

    def find(self, text: str, path: str = "file.txt") -> tuple[set[str], dict[int, set[str]], Counter]:
        """What detect-secrets finds: (token values, line → keyword values, counts per kind)."""
        _configure()
        from detect_secrets.core.scan import _is_filtered_out, _scan_line
        from detect_secrets.settings import get_plugins
        from detect_secrets.util.code_snippet import get_code_snippet

        if self._gates is None:
            self._gates = line_gates()
        lines = text.split("\n")
        keys: set[str] = set()  # token values: replaced everywhere (the same key pasted twice)
        words: dict[int, set[str]] = {}  # line → keyword values: replaced where found (`yes` may be a password)
        counts: Counter = Counter()
        for i in candidate_lines(text, self._gates):
            line = lines[i].rstrip()
            snippet = get_code_snippet(lines=lines, line_number=i + 1)
            for plugin in get_plugins():
                for secret in _scan_line(plugin=plugin, filename=path, line=line, line_number=i + 1, context=snippet):
                    value, password = secret.secret_value, secret.type in PASSWORD_TYPES
                    if not value or value in keys or value in words.get(i, ()) or _is_filtered_out(
                            required_filter_parameters=["context"], filename=path, secret=value, plugin=plugin,
                            line=line, context=snippet):
                        continue
                    (words.setdefault(i, set()) if password else keys).add(value)
                    counts["password" if password else _slug(secret.type)] += 1
        return keys, words, counts

    def _detect_secrets(self, text: str, path: str, counts: Counter) -> str:
        keys, words, found = self.find(text, path)
        counts.update(found)
        lines = text.split("\n")
        for i, values in words.items():  # not inside a longer word
            for value in sorted(values, key=len, reverse=True):
                lines[i] = re.sub(r"(?<![A-Za-z0-9_])%s(?![A-Za-z0-9_])" % re.escape(value), "<PASSWORD>", lines[i])
        text = "\n".join(lines) if words else text
        for value in sorted(keys, key=len, reverse=True):  # with the rest of a token a lazy pattern stopped short of
            text = re.sub(re.escape(value) + r"[A-Za-z0-9_\-+/=.]*", "<KEY>", text)
        return text

    @staticmethod
    def _ip_repl(m: re.Match, text: str, counts: Counter) -> str:
        import ipaddress

        value = m.group(0)
        try:
            public = ipaddress.ip_address(value).is_global
        except ValueError:
            return value
        context = text[max(0, m.start() - 100):m.end() + 100].lower()
        version_like = len(value) == 7 and "dns" not in context and "server" not in context
        if not public or value in DNS_SERVERS or version_like:
            return value
        counts["ip_address"] += 1
        return "<IP_ADDRESS>"


class Redact(PipelineStep):
    """Redacts the documents of the sources with a `Redactor` (source name → Redactor), counting each
    finding as `redacted:<kind>` and each document changed as `redacted_documents`; never drops one."""

    name = "🕵️ redact"
    type = "✂️ - FORMAT"

    def __init__(self, redactors: dict[str, Redactor]):
        super().__init__()
        self.redactors = redactors

    def run(self, data, rank: int = 0, world_size: int = 1):
        for doc in data:
            r = self.redactors.get(doc.metadata.get("source"))
            if r is not None:
                doc.text, counts = r.redact(doc.text, doc.metadata.get("path") or doc.id or "file.txt")
                if counts:
                    self.stat_update("redacted_documents")
                    for k, v in counts.items():
                        self.stat_update(f"redacted:{k}", value=v)
            yield doc
