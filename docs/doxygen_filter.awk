# Doxygen-only rendering of the headers' indented comment blocks (shape lists,
# formulas, mask diagrams): a run of /// lines indented under a paragraph is
# shown preformatted (<pre>...</pre> on its first and last line), as it reads
# in the header. A list item's 2-space continuation lines stay text. Lines are
# neither added nor removed.
function flush(   i) {
  if (n == 0) return
  sub(/\/\/\/ /, "/// <pre>", buf[1])
  buf[n] = buf[n] "</pre>"
  for (i = 1; i <= n; i++) print buf[i]
  n = 0
}
{
  line = $0
  if (match(line, /^[ \t]*\/\/\/($|[^\/<])/)) {
    t = line; sub(/^[ \t]*\/\/\//, "", t)  # text after ///
    if (t ~ /\\verbatim|\\code|```/) verb = 1
    if (verb) { flush(); print line; if (t ~ /\\endverbatim|\\endcode/) verb = 0; next }
    if (t ~ /^ ?$/) { flush(); item = 0; print line; next }
    if (t ~ /^ [-*] / || t ~ /^ [0-9]+\. /) { flush(); item = 1; print line; next }
    ind = match(t, /[^ ]/) - 1              # spaces before the text
    if ((item && ind >= 5) || (!item && ind >= 3)) { buf[++n] = line; next }
    flush()
    if (!(item && ind == 3)) item = 0
    print line
    next
  }
  flush(); item = 0; print line
}
END { flush() }
