/**
 * monarch_nb in JupyterLab: a status-bar item with the current notebook's mesh and
 * a side panel that docks its dashboard and a debugger console. Both talk to the
 * kernel through the `monarch_nb` comm (./channel.ts); a kernel without monarch_nb
 * leaves them quiet.
 */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { INotebookTracker } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';

import { CurrentMesh } from './current';
import { MeshPanel } from './panel';
import { MeshStatusItem } from './status';

const OPEN_PANEL = 'monarch-nb:open-panel';

const meshIcon = new LabIcon({
  name: 'monarch-nb:mesh',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" width="16">' +
    '<g class="jp-icon3" fill="#616161">' +
    '<rect x="3" y="3" width="7" height="7" rx="1.5"/><rect x="14" y="3" width="7" height="7" rx="1.5"/>' +
    '<rect x="3" y="14" width="7" height="7" rx="1.5"/><rect x="14" y="14" width="7" height="7" rx="1.5"/>' +
    '</g></svg>'
});

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'monarch-nb:plugin',
  description: 'The monarch_nb mesh of the current notebook: status-bar item and side panel.',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [IStatusBar, ICommandPalette],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    statusBar: IStatusBar | null,
    palette: ICommandPalette | null
  ) => {
    const current = new CurrentMesh(tracker);
    const panel = new MeshPanel(current);
    panel.title.icon = meshIcon;
    panel.title.caption = 'monarch_nb mesh';
    app.shell.add(panel, 'right', { rank: 900 });
    app.commands.addCommand(OPEN_PANEL, {
      label: 'Show the monarch_nb mesh panel',
      execute: () => app.shell.activateById(panel.id)
    });
    palette?.addItem({ command: OPEN_PANEL, category: 'monarch_nb' });
    if (statusBar !== null) {
      const item = new MeshStatusItem(current, () => void app.commands.execute(OPEN_PANEL));
      statusBar.registerStatusItem('monarch-nb:status', {
        item,
        align: 'left',
        rank: 5,
        isActive: () => current.summary !== null,
        activeStateChanged: current.changed
      });
    }
  }
};

export default plugin;
