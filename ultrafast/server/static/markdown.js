// The playground's Markdown renderer: escape everything first, then add a few tags; links
// only to http(s). Inlined into the page by server/playground.py.
function escapeHtml(s) {
  return s.replace(/[&<>"']/g, (c) =>
    ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"})[c]);
}

function renderInline(escaped) {
  // code spans and links are set aside first, so emphasis never reaches into them
  const held = [];
  const hold = (html) => "\u0000" + (held.push(html) - 1) + "\u0000";
  let s = escaped.replace(/`([^`]+)`/g, (_, code) => hold("<code>" + code + "</code>"));
  s = s.replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g, (_, text, url) =>
    hold(`<a href="${url}" target="_blank" rel="noopener noreferrer">${text}</a>`));
  // emphasis hugs its text (no space inside the markers), so code such as f(*args, **kw)
  // or snake_case names stays as written
  s = s.replace(/\*\*([^*\s](?:[^*]*[^*\s])?)\*\*/g, "<strong>$1</strong>");
  s = s.replace(/(^|[^*\w])\*([^*\s](?:[^*]*[^*\s])?)\*(?![\w*])/g, "$1<em>$2</em>");
  s = s.replace(/(^|[^_\w])_([^_\s](?:[^_]*[^_\s])?)_(?![\w_])/g, "$1<em>$2</em>");
  const restore = (t) => t.replace(/\u0000(\d+)\u0000/g, (_, i) => held[Number(i)]);
  return restore(restore(s));  // twice: a link's text may hold a code span
}

function renderMarkdown(source) {
  const lines = source.replace(/\u0000/g, "").split("\n");
  const out = [];
  let para = [], list = null;
  const flushPara = () => {
    if (para.length) out.push("<p>" + para.map(renderInline).join("\n") + "</p>");
    para = [];
  };
  const flushList = () => {
    if (list) out.push(`<${list.tag}>` + list.items.map((i) => "<li>" + renderInline(i) +
                       "</li>").join("") + `</${list.tag}>`);
    list = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const raw = lines[i];
    const fence = raw.match(/^\s*```\s*([\w+#.-]*)\s*$/);
    if (fence) {  // a code fence runs to its closing fence, or to the end while streaming
      flushPara(); flushList();
      const code = [];
      for (i += 1; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) {
        code.push(escapeHtml(lines[i]));
      }
      const lang = fence[1] ? ` class="language-${escapeHtml(fence[1])}"` : "";
      out.push(`<pre><code${lang}>${code.join("\n")}</code></pre>`);
      continue;
    }
    const line = escapeHtml(raw);
    const heading = line.match(/^(#{1,4})\s+(.*)$/);
    const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
    const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
    if (!line.trim()) { flushPara(); flushList(); }
    else if (heading) {
      flushPara(); flushList();
      const level = heading[1].length + 2;  // h3..h6: the page title stays the largest
      out.push(`<h${level}>${renderInline(heading[2])}</h${level}>`);
    } else if (bullet || numbered) {
      flushPara();
      const tag = bullet ? "ul" : "ol";
      if (list && list.tag !== tag) flushList();
      if (!list) list = {tag, items: []};
      list.items.push((bullet || numbered)[1]);
    } else { flushList(); para.push(line); }
  }
  flushPara(); flushList();
  return out.join("");
}
