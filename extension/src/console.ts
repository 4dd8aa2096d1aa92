/**
 * The panel's debugger console: pick a paused session, type pdb commands (Enter
 * sends, the arrow keys walk the history), read the replies.
 */
import { Widget } from '@lumino/widgets';

import { ISession, MeshChannel } from './channel';

const LOG_CHARS = 20_000; // the end of the log that is kept
const HISTORY = 500; // commands remembered

/** Command history as in a shell: up goes back, down comes forward to the draft. */
export class History {
  push(line: string): void {
    if (line && this._lines[this._lines.length - 1] !== line) {
      this._lines.push(line);
      this._lines.splice(0, Math.max(0, this._lines.length - HISTORY));
    }
    this._at = this._lines.length;
    this._draft = '';
  }

  /** The line before (``current`` is kept as the draft when leaving it). */
  up(current: string): string {
    if (this._at === this._lines.length) {
      this._draft = current;
    }
    this._at = Math.max(0, this._at - 1);
    return this._lines[this._at] ?? current;
  }

  down(): string {
    this._at = Math.min(this._lines.length, this._at + 1);
    return this._at === this._lines.length ? this._draft : this._lines[this._at];
  }

  private _lines: string[] = [];
  private _at = 0;
  private _draft = '';
}

export class DebuggerConsole extends Widget {
  constructor() {
    super();
    this.addClass('mnb-lab-console');
    const bar = document.createElement('div');
    bar.className = 'mnb-lab-console-bar';
    const title = document.createElement('b');
    title.textContent = 'debugger';
    this._select.className = 'mnb-lab-session';
    this._continue.className = 'mnb-lab-continue jp-mod-styled';
    this._continue.textContent = 'continue all';
    this._continue.addEventListener('click', () => this._send('continue', {}));
    bar.append(title, this._continue);
    this._log.className = 'mnb-lab-console-log';
    this._input.className = 'mnb-lab-console-input';
    this._input.spellcheck = false;
    this._input.addEventListener('keydown', this._onKey);
    this.node.append(bar, this._select, this._log, this._input);
    this.bind(null);
  }

  /** Show the console of ``channel`` (null: none) with its paused sessions. */
  bind(channel: MeshChannel | null): void {
    if (channel !== this._channel) {
      this._channel = channel;
      this._log.textContent = channel?.log ?? '';
      this._scroll();
    }
    this._sessions(channel?.summary?.sessions ?? []);
  }

  private _sessions(sessions: ISession[]): void {
    const options: [string, string][] = sessions.map(s => [
      s.label,
      JSON.stringify([s.rank, s.stream])
    ]);
    if (sessions.length > 1) {
      options.push(['every paused session (cast)', '"*"']);
    }
    const key = JSON.stringify(options);
    if (key !== this._key) {
      this._key = key;
      const keep = this._select.value;
      this._select.replaceChildren(
        ...options.map(([label, value]) => {
          const o = document.createElement('option');
          o.textContent = label;
          o.value = value;
          return o;
        })
      );
      if (options.some(([, v]) => v === keep)) {
        this._select.value = keep; // the session selected before stays selected
      }
    }
    const none = sessions.length === 0;
    this._select.disabled = none;
    this._continue.disabled = none;
    this._input.placeholder = none
      ? 'no paused session: breakpoint() in a %%monarch cell pauses one'
      : 'pdb command (p x, ll, n, c …): Enter sends, ↑ ↓ history';
  }

  private _onKey = (e: KeyboardEvent): void => {
    if (e.key === 'Enter') {
      e.preventDefault();
      const line = this._input.value;
      if (!line.trim()) {
        return;
      }
      this._history.push(line);
      this._input.value = '';
      this._send('pdb', { target: JSON.parse(this._select.value || 'null'), line });
    } else if (e.key === 'ArrowUp') {
      e.preventDefault();
      this._input.value = this._history.up(this._input.value);
    } else if (e.key === 'ArrowDown') {
      e.preventDefault();
      this._input.value = this._history.down();
    }
  };

  private _send(kind: string, extra: { [k: string]: any }): void {
    const channel = this._channel;
    if (channel === null) {
      return;
    }
    channel.request(kind, extra).then(
      reply => this._append(channel, (reply.lines ?? [reply.error ?? '']).join('\n')),
      (e: Error) => this._append(channel, `${extra.line ?? kind}: ${e.message}`)
    );
  }

  private _append(channel: MeshChannel, text: string): void {
    channel.log = (channel.log + text + '\n').slice(-LOG_CHARS);
    if (channel === this._channel) {
      this._log.textContent = channel.log;
      this._scroll();
    }
  }

  private _scroll(): void {
    this._log.scrollTop = this._log.scrollHeight;
  }

  private _channel: MeshChannel | null = null;
  private _key = '';
  private _history = new History();
  private _select = document.createElement('select');
  private _continue = document.createElement('button');
  private _log = document.createElement('pre');
  private _input = document.createElement('input');
}
