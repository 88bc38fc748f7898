// A small Markdown renderer for model replies, built for untrusted text.
//
// It never parses HTML: it builds DOM nodes itself (createElement / createTextNode), so every
// character the model wrote ends up as text, and `<script>` or `<img onerror>` in a reply is shown,
// not run. What it knows: fenced code blocks (an unclosed fence runs to the end, as a reply streams
// in), indented code, headings, horizontal rules, block quotes, bullet and numbered lists (nested by
// indentation), GitHub tables, paragraphs with line breaks, and inline code, bold, italic,
// strikethrough and http(s) links. Anything else stays as the text it was.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})(?:\s+(.*?))?(?:\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const ITEM = /^( *)([-*+]|\d{1,9}[.)])(?:\s+(.*))?$/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
const LANGUAGE = /^[\w+#.-]{1,32}$/;
const SAFE_URL = /^https?:\/\/[^\s<>"]+$/i;
const MAX_DEPTH = 12; // nested quotes and lists beyond this stay text (a reply of '> > > …' cannot exhaust the stack)

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

const blank = (line) => line.trim() === "";
const indentOf = (line) => line.match(/^ */)[0].length;

function startsBlock(line, next) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line)
    || (line.includes("|") && next !== undefined && TABLE_RULE.test(next) && next.includes("-"));
}

function splitRow(line) {
  let row = line.trim();
  if (row.startsWith("|")) row = row.slice(1);
  if (row.endsWith("|") && !row.endsWith("\\|")) row = row.slice(0, -1);
  const cells = [];
  let cell = "";
  for (let i = 0; i < row.length; i++) {
    if (row[i] === "\\" && row[i + 1] === "|") { cell += "|"; i++; } else if (row[i] === "|") { cells.push(cell.trim()); cell = ""; } else cell += row[i];
  }
  cells.push(cell.trim());
  return cells;
}

function codeBlock(text, language) {
  const box = el("div", "code");
  const head = el("div", "code-head");
  head.append(el("span", "code-lang", language || "text"));
  const copy = el("button", "copy", "copy");
  copy.type = "button";
  head.append(copy);
  const pre = el("pre");
  const code = el("code", LANGUAGE.test(language) ? `language-${language}` : "", text);
  pre.append(code);
  box.append(head, pre);
  return box;
}

function renderBlocks(lines, parent, depth = 0) {
  if (depth > MAX_DEPTH) {
    parent.append(el("p", "plain", lines.join("\n")));
    return;
  }
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (blank(line)) { i++; continue; }

    let m = line.match(FENCE);
    if (m) {
      const fence = m[1];
      const body = [];
      i++;
      while (i < lines.length) {
        const close = lines[i].match(/^ {0,3}(`{3,}|~{3,})\s*$/);
        if (close && close[1][0] === fence[0] && close[1].length >= fence.length) { i++; break; }
        body.push(lines[i]);
        i++;
      }
      parent.append(codeBlock(body.join("\n"), m[2]));
      continue;
    }

    if (indentOf(line) >= 4 && !ITEM.test(line)) {
      const body = [];
      while (i < lines.length && (indentOf(lines[i]) >= 4 || blank(lines[i]))) { body.push(lines[i].slice(4)); i++; }
      while (body.length && blank(body[body.length - 1])) body.pop();
      parent.append(codeBlock(body.join("\n"), ""));
      continue;
    }

    m = line.match(HEADING);
    if (m) {
      const h = el(`h${m[1].length}`);
      renderInline(m[2] || "", h);
      parent.append(h);
      i++;
      continue;
    }

    if (RULE.test(line)) { parent.append(el("hr")); i++; continue; }

    if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && !blank(lines[i])) {
        const q = lines[i].match(QUOTE);
        body.push(q ? q[1] : lines[i]);
        i++;
      }
      const quote = el("blockquote");
      renderBlocks(body, quote, depth + 1);
      parent.append(quote);
      continue;
    }

    m = line.match(ITEM);
    if (m) { i = renderList(lines, i, parent, depth); continue; }

    if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]) && lines[i + 1].includes("-")) {
      i = renderTable(lines, i, parent);
      continue;
    }

    const body = [line];
    i++;
    while (i < lines.length && !blank(lines[i]) && !startsBlock(lines[i], lines[i + 1])) { body.push(lines[i]); i++; }
    const p = el("p");
    renderInline(body.map((l) => l.trim()).join("\n"), p);
    parent.append(p);
  }
}

function renderList(lines, i, parent, depth) {
  const first = lines[i].match(ITEM);
  const base = first[1].length;
  const ordered = /\d/.test(first[2]);
  const list = el(ordered ? "ol" : "ul");
  if (ordered) {
    const start = parseInt(first[2], 10);
    if (start !== 1) list.setAttribute("start", String(start));
  }
  let loose = false;
  while (i < lines.length) {
    const m = lines[i].match(ITEM);
    if (!m || m[1].length !== base || /\d/.test(m[2]) !== ordered) break;
    const contentIndent = base + m[2].length + 1;
    const body = [m[3] || ""];
    i++;
    while (i < lines.length) {
      const line = lines[i];
      if (blank(line)) {
        if (i + 1 < lines.length && indentOf(lines[i + 1]) > base) { body.push(""); i++; continue; }
        break;
      }
      const item = line.match(ITEM);
      if (item && item[1].length <= base) break;
      if (indentOf(line) <= base && startsBlock(line, lines[i + 1])) break;
      body.push(line.slice(Math.min(indentOf(line), contentIndent)));
      i++;
    }
    if (i < lines.length && blank(lines[i])) {
      let j = i;
      while (j < lines.length && blank(lines[j])) j++;
      const next = j < lines.length ? lines[j].match(ITEM) : null;
      if (next && next[1].length === base && /\d/.test(next[2]) === ordered) { loose = true; i = j; }
    }
    const li = el("li");
    renderBlocks(body, li, depth + 1);
    list.append(li);
  }
  if (!loose) {
    for (const li of list.children) {
      if (li.firstChild && li.firstChild.tagName === "P") li.firstChild.replaceWith(...li.firstChild.childNodes);
    }
  }
  parent.append(list);
  return i;
}

function renderTable(lines, i, parent) {
  const header = splitRow(lines[i]);
  const aligns = splitRow(lines[i + 1]).map((c) => (c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : ""));
  const wrap = el("div", "table");
  const table = el("table");
  const tr = el("tr");
  header.forEach((cell, k) => {
    const th = el("th");
    if (aligns[k]) th.className = `align-${aligns[k]}`;
    renderInline(cell, th);
    tr.append(th);
  });
  table.append(el("thead"));
  table.firstChild.append(tr);
  const tbody = el("tbody");
  i += 2;
  while (i < lines.length && !blank(lines[i]) && lines[i].includes("|")) {
    const row = el("tr");
    splitRow(lines[i]).forEach((cell, k) => {
      if (k >= header.length) return;
      const td = el("td");
      if (aligns[k]) td.className = `align-${aligns[k]}`;
      renderInline(cell, td);
      row.append(td);
    });
    tbody.append(row);
    i++;
  }
  table.append(tbody);
  wrap.append(table);
  parent.append(wrap);
  return i;
}

const PUNCTUATION = /[!-/:-@[-`{-~]/;
const WORD = /[\p{L}\p{N}]/u;

// The end of a `delim`-delimited span that starts at `from`, or -1: not right after an opening space,
// not before a closing space, and for `_` not inside a word.
function closing(text, delim, from) {
  if (from >= text.length || /\s/.test(text[from])) return -1;
  let j = from;
  while ((j = text.indexOf(delim, j)) !== -1) {
    const before = text[j - 1];
    const after = text[j + delim.length];
    const inWord = delim[0] === "_" && after !== undefined && WORD.test(after);
    const doubled = delim.length === 1 && text[j + 1] === delim;
    if (j > from && !/\s/.test(before) && before !== "\\" && !inWord && !doubled) return j;
    j += doubled ? 2 : 1;
  }
  return -1;
}

function renderInline(text, parent) {
  let buffer = "";
  const flush = () => {
    if (!buffer) return;
    const parts = buffer.split("\n");
    parts.forEach((part, k) => {
      if (k) parent.append(el("br"));
      if (part) parent.append(document.createTextNode(part));
    });
    buffer = "";
  };
  let i = 0;
  while (i < text.length) {
    const c = text[i];
    if (c === "\\" && i + 1 < text.length && PUNCTUATION.test(text[i + 1])) {
      buffer += text[i + 1];
      i += 2;
      continue;
    }
    if (c === "`") {
      let n = 1;
      while (text[i + n] === "`") n++;
      const ticks = "`".repeat(n);
      let j = i + n;
      let end = -1;
      while ((j = text.indexOf(ticks, j)) !== -1) {
        if (text[j + n] !== "`" && text[j - 1] !== "`") { end = j; break; }
        while (text[j] === "`") j++;
      }
      if (end !== -1) {
        let inner = text.slice(i + n, end).replace(/\n/g, " ");
        if (inner.length > 2 && inner.startsWith(" ") && inner.endsWith(" ")) inner = inner.slice(1, -1);
        flush();
        parent.append(el("code", "", inner));
        i = end + n;
        continue;
      }
      buffer += ticks;
      i += n;
      continue;
    }
    const pair = text.slice(i, i + 2);
    if (pair === "**" || pair === "__" || pair === "~~") {
      const end = closing(text, pair, i + 2);
      const leftOk = pair !== "__" || i === 0 || !WORD.test(text[i - 1]);
      if (end !== -1 && leftOk) {
        flush();
        const node = el(pair === "~~" ? "del" : "strong");
        renderInline(text.slice(i + 2, end), node);
        parent.append(node);
        i = end + 2;
        continue;
      }
    } else if (c === "*" || c === "_") {
      const end = closing(text, c, i + 1);
      const leftOk = c === "*" || i === 0 || !WORD.test(text[i - 1]);
      if (end !== -1 && leftOk) {
        flush();
        const node = el("em");
        renderInline(text.slice(i + 1, end), node);
        parent.append(node);
        i = end + 1;
        continue;
      }
    } else if (c === "[") {
      const m = text.slice(i).match(/^\[([^\]\n]+)\]\(([^)\s]+)\)/);
      if (m && SAFE_URL.test(m[2])) {
        flush();
        const a = el("a");
        a.href = m[2];
        a.target = "_blank";
        a.rel = "noopener noreferrer nofollow";
        renderInline(m[1], a);
        parent.append(a);
        i += m[0].length;
        continue;
      }
    }
    buffer += c;
    i++;
  }
  flush();
}

/** The reply `text` as a fragment of elements (text only ever in text nodes). */
export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  try {
    renderBlocks(String(text).replace(/\r\n?/g, "\n").split("\n"), fragment);
  } catch (error) { // a bug here must not lose the reply: show it as plain text
    fragment.replaceChildren(el("p", "plain", String(text)));
  }
  return fragment;
}
